"""What a user imports: the one TrainStep (runtime) and TunedConfig; the Recipe and SearchSpace they carry live in autotune.recipe and autotune.space."""
