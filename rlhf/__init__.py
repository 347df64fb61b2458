"""rlhf: the library the pipeline stages share.

Importing the package first puts the process in offline, no-telemetry mode (see
`rlhf.environment`), so every entry point that imports anything from `rlhf` is safe to run
on a machine with no internet.
"""

from rlhf.environment import configure_offline_environment

configure_offline_environment()
