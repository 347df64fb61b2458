"""rlhf: the library the pipeline stages share.

Importing the package first puts the process in no-telemetry mode (see
`rlhf.environment`); the Hugging Face Hub stays reachable unless the user sets
`HF_HUB_OFFLINE=1`.
"""

from rlhf.environment import configure_environment

configure_environment()
