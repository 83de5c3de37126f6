"""Time: each op's roofline time, and a rank's step as a timeline of tasks on streams."""
