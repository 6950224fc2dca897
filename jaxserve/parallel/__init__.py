"""The device mesh, and where every array of an engine lives on it."""
