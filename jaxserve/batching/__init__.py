"""Host-side loop: sequences, step batches, and the loop that drives the steps."""
