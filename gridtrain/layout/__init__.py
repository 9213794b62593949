"""The layout core, torch-free: the degrees of a layout and their rank grid (`dims`), and the
pipeline schedules (`schedules`). The planner and the runtime both build on it."""
