"""Process launch: where am I (env), torch.distributed start-up (dist), self-spawn (spawn).

    from distnorm.launch import init_distributed, spawn, run_distributed
    env = init_distributed()     # under torchrun / mpirun / spawn / plain python
    ...
    shutdown()                   # every rank leaves torch.distributed together
"""
from distnorm.launch.dist import (cleanup, free_port, get_or_create_group, init_distributed,
                                  local_device_index, mpi_comm_world, shutdown, split_world)
from distnorm.launch.env import (LAUNCHERS, NO_MULTICAST_ENV, LaunchEnv, apply_no_multicast_env,
                                 detect_launch_env, without_launcher_vars)
from distnorm.launch.spawn import in_multiprocess_launch, launch_world_size, run_distributed, spawn

__all__ = [
    "LaunchEnv", "detect_launch_env", "LAUNCHERS", "NO_MULTICAST_ENV", "apply_no_multicast_env",
    "without_launcher_vars", "init_distributed", "cleanup", "shutdown", "get_or_create_group", "split_world", "free_port",
    "mpi_comm_world", "local_device_index",
    "spawn", "run_distributed", "in_multiprocess_launch", "launch_world_size",
]
