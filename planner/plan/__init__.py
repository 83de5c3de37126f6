"""What a plan chooses: knobs, precision and optimizer, the parallel layout, checkpoint policies, and the schedule of a step's events."""
