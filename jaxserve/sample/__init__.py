"""On-device sampling and what shapes it: verification of proposals, token masks, logit controls, prompt logprobs."""
