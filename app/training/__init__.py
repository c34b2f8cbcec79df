"""Training on this engine's episodes: a rollout function for TRL's GRPOTrainer (rollout.EngineRollout), the
policy's weights synced into the engine (weights), and rewards from the environment (rewards). The only package
that imports TRL (requirements-train.txt)."""
