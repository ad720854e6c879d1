"""What a user imports: the Recipe, the SearchSpace it was chosen from, the one TrainStep (runtime) and TunedConfig."""
