"""What is trained: the model and its inputs (models by name or factory) and the data."""
