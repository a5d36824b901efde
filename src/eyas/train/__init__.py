"""Training the draft: data from the store, the TTT loss, optimizer and schedule, checkpoints, the loop."""
