"""average: checkpoints averaged tensor by tensor (model soups, EMA of the last N), torch-free."""
