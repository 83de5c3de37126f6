"""The step program of a plan point and the estimate read off it."""
