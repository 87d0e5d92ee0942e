"""Stage backends: one StageBackend protocol (``backends.base``) over PyTorch and MLX.

Importing this package imports neither torch nor mlx; ``backends.registry``
creates a backend by name on the calling (compute) thread.
"""
