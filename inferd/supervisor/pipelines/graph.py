"""A pipeline as the supervisor runs it: its steps, each with the tensors it takes (in its model's input order)
and makes (by its model's output index), and its inputs as a model's, to check a request against."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from inferd.config.pipelines import output_index
from inferd.config.schema import ModelConfig, PipelineConfig


@dataclass(frozen=True)
class Step:
    """One step of a pipeline."""

    index: int
    title: str
    model: str
    takes: tuple[str, ...]  # the pipeline's tensor for each of the model's inputs, in order
    makes: tuple[tuple[int, str], ...]  # (the model's output index, the pipeline's tensor it becomes)


@dataclass(frozen=True)
class Graph:
    """A checked pipeline (config/pipelines.py refused every other)."""

    name: str
    config: PipelineConfig
    steps: tuple[Step, ...]
    inputs: ModelConfig  # the pipeline's inputs as a model's, and the most samples every step takes

    @classmethod
    def build(cls, name: str, config: PipelineConfig, models: dict[str, ModelConfig]) -> Graph:
        """The graph of pipeline `name`, whose steps run `models`."""
        steps = []
        for index, step in enumerate(config.steps):
            model = models[step.model]
            makes = tuple((at, tensor) for output, tensor in step.outputs.items()
                          if (at := output_index(model, output)) is not None)
            steps.append(Step(index, step.title, step.model, tuple(step.inputs[n] for n in model.input_names()),
                              makes))
        most = min(models[step.model].max_batch_size for step in config.steps)
        inputs = ModelConfig(inputs=tuple(spec.as_input() for spec in config.inputs), max_batch_size=most)
        return cls(name, config, tuple(steps), inputs)

    def ready(self, have: Container[str], started: set[int]) -> list[Step]:
        """The steps not started yet whose every input is among `have`, in the pipeline's order."""
        return [step for step in self.steps if step.index not in started and all(t in have for t in step.takes)]


def graphs(pipelines: dict[str, PipelineConfig], models: dict[str, ModelConfig]) -> dict[str, Graph]:
    """Every pipeline's graph."""
    return {name: Graph.build(name, config, models) for name, config in pipelines.items()}
