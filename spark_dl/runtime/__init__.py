"""What a training task runs on, whatever its strategy: its configuration, its shard and the
barrier-stage scaffold (stage.py), its checkpoint files (checkpoint.py), mixed precision
(amp.py), its errors sent to the driver (failures.py), and the Python worker daemon that
forks it with torch loaded (daemon.py)."""
