"""RL training math and the torch trainer: triplets -> TrainingBatch -> advantages -> clipped policy loss -> update."""
