"""The studies: reproduce, replay, capacity, ablate, tune. They run the simulator."""
