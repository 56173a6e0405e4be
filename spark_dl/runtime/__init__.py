"""What a training task runs on, whatever its strategy: its configuration, its shard and the
barrier-stage scaffold (stage.py), its checkpoint files (checkpoint.py), mixed precision
(amp.py), and its errors sent to the driver (failures.py)."""
