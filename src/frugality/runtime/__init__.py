"""What a command needs to run a model: the device (`device`), the training data
(`data`), and the one builder of the training state (`state`)."""
