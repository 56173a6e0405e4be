"""What a training task runs on, whatever its strategy: its configuration, its shard, the
barrier-stage scaffold, losses and checkpoint files (stage.py), mixed precision (amp.py), and
its errors sent to the driver (failures.py)."""
