"""Planning a model-parallel fit: what one step of a model split over F tasks costs, and the
planner that picks F and R (cost_model.py); Downpour's partitions="auto", its checks of the
thesis algorithm and how the parameter server lays out a split model (partitions.py)."""
