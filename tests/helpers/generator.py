"""Test-only generators: a VllmGenerator whose engine records what refit loads (see helpers.refit),
and groups that run it or let a test call any engine method.

    RecordingGeneratorGroup(recording_config(model=...), options)
    ProbedGeneratorGroup(GeneratorConfig(...), options)      # plain engines, .call(method) on each
"""

from __future__ import annotations

from tests.helpers.refit import RECORDING_EXTENSION
from workers.generator.actor import GeneratorConfig, VllmGenerator
from workers.generator.group import GeneratorGroup


def recording_config(**kwargs) -> GeneratorConfig:
    return GeneratorConfig(worker_extension=RECORDING_EXTENSION, **kwargs)


class RecordingGenerator(VllmGenerator):
    def refit_record(self, on: bool) -> None:
        self.llm.collective_rpc("refit_record", args=(on,))

    def refit_recorded(self) -> dict:
        return self.llm.collective_rpc("refit_recorded")[0]

    def refit_rename(self, name: str | None, new_name: str | None = None) -> None:
        self.llm.collective_rpc("refit_rename", args=(name, new_name))

    def apply_refit_keeping_prefix_cache(self, payload) -> dict:
        """apply_refit without its prefix-cache reset: the test that proves the reset is needed."""
        return self._apply_refit(payload)

    def refit_recorded_in_config(self) -> bool | None:
        return self.llm.collective_rpc("refit_recorded_in_config")[0]

    def refit_storage_mark(self) -> dict:
        return self.llm.collective_rpc("refit_storage_mark")[0]

    def refit_storage_moved(self) -> list[str]:
        return self.llm.collective_rpc("refit_storage_moved")[0]

    def refit_plant_replace(self, name: str, how: str) -> None:
        self.llm.collective_rpc("refit_plant_replace", args=(name, how))


class ProbedGeneratorGroup(GeneratorGroup):
    """A GeneratorGroup whose tests call any engine method on every engine."""

    def call(self, method: str, *args, **kwargs) -> list:
        import ray

        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])


class RecordingGeneratorGroup(ProbedGeneratorGroup):
    ACTOR = RecordingGenerator

    def apply_refit_keeping_prefix_cache(self, payload) -> dict:
        """apply_refit, every engine keeping its prefix cache (which the real path drops)."""
        from workers.refit.control import wait_all

        return self.refit_summary(wait_all([a.apply_refit_keeping_prefix_cache.remote(payload) for a in self.actors]))
