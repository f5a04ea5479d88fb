"""Test-only generator: a VllmGenerator whose engine records what refit loads (see helpers.refit).

    GeneratorGroup(recording_config(model=...), options, actor_cls=RecordingGenerator)
"""

from __future__ import annotations

from tests.helpers.refit import RECORDING_EXTENSION
from workers.generator.actor import GeneratorConfig, VllmGenerator


def recording_config(**kwargs) -> GeneratorConfig:
    return GeneratorConfig(worker_extension=RECORDING_EXTENSION, **kwargs)


class RecordingGenerator(VllmGenerator):
    def refit_record(self, on: bool) -> None:
        self.llm.collective_rpc("refit_record", args=(on,))

    def refit_recorded(self) -> dict:
        return self.llm.collective_rpc("refit_recorded")[0]

    def refit_rename(self, name: str | None, new_name: str | None = None) -> None:
        self.llm.collective_rpc("refit_rename", args=(name, new_name))
