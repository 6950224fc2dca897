"""`python -m jaxserve.cli`: the `jaxserve` command."""
import sys

from jaxserve.cli import main

sys.exit(main())
