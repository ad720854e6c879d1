"""The study: options, space, seeds, budget, objective, steering and findings, storage, the run loop."""
