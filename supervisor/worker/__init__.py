"""The worker: its loop and jobs, the pure plan, actions, heartbeat, telemetry, notify, wakeup."""
