"""Planning a run before it starts: the step simulator (each stage's time on a device class)
and the automatic placement search over resource pools (`rl3d plan --auto-place`)."""
