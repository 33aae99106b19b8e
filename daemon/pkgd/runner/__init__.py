"""Model execution: weights, models, attention, sampling."""
