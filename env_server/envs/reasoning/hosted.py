"""One env class per hosted reasoning-gym dataset, made from its registry entry at import.

Each class is an attribute of this module named after its dataset (``reasoning/basic_arithmetic``
is ``BasicArithmeticEnv``), which is what the ``stargym.envs`` entry points in pyproject.toml
name; a test keeps the two in step when reasoning-gym adds or drops a dataset.
"""

from __future__ import annotations

from env_server.envs.reasoning.catalog import hosted_datasets
from env_server.envs.reasoning.env import ReasoningEnv, env_class

ENV_CLASSES: dict[str, type[ReasoningEnv]] = {
    cls.env_id(): cls for cls in (env_class(info, __name__) for info in hosted_datasets())
}
globals().update({cls.__name__: cls for cls in ENV_CLASSES.values()})
