"""Drop-in checkpointing for training frameworks, each a one-line switch in the framework's config:

- `olmo_chunks.integrations.olmo_core.OlmoChunksCheckpointerConfig` for OLMo-core's
  `TrainerConfig(checkpointer=...)` (`pip install olmo-chunks[olmo-core]`);
- `olmo_chunks.integrations.torchtitan.ChunkStoreCheckpointManager.Config` for torchtitan's
  `Trainer.Config(checkpoint=...)` (`pip install olmo-chunks[torchtitan]`).

Each module imports its framework; this package imports neither.
"""
