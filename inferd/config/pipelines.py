"""A pipeline's graph, from its config: which step makes each tensor and which takes it, the order they can
run in, and every way the config cannot be served, each said in one sentence naming the pipeline, step and
tensor (what `inferd check-config`, the start and a SIGHUP refuse)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from inferd.config.schema import ModelConfig, PipelineConfig, PipelineStep

UNNAMED_OUTPUT = re.compile(r"^OUTPUT__(\d+)$")


@dataclass(frozen=True)
class Producer:
    """What makes a tensor: a step (its index) and that model's output, or the pipeline's input (step None)."""

    step: int | None
    dtype: str | None
    shape: tuple[int, ...] | None
    said: str  # how a sentence names it


def output_index(model: ModelConfig, name: str) -> int | None:
    """The index of `model`'s output `name` (a configured name, or OUTPUT__<i> past the named ones); None if
    the model has no such output."""
    for index in range(len(model.outputs)):
        if model.output_name(index) == name:
            return index
    unnamed = UNNAMED_OUTPUT.match(name)
    if unnamed is not None and int(unnamed.group(1)) >= len(model.outputs):
        return int(unnamed.group(1))
    return None


def _shapes_agree(made: tuple[int, ...], taken: tuple[int, ...]) -> bool:
    return len(made) == len(taken) and all(a == b or -1 in (a, b) for a, b in zip(made, taken))


def _step_problems(prefix: str, index: int, step: PipelineStep, model: ModelConfig) -> list[str]:
    where, names = f"{prefix}.steps[{index}]: step {step.title}", model.input_names()
    problems = [f"{where} maps input {given!r}, which model {step.model} does not have; it takes "
                f"{', '.join(names)}" for given in step.inputs if given not in names]
    problems += [f"{where} maps no tensor to input {name!r} of model {step.model}; map each of its inputs "
                 f"({', '.join(names)})" for name in names if name not in step.inputs]
    problems += [f"{where} maps output {given!r}, which model {step.model} does not have; its outputs are named in "
                 "its config's `outputs`, else OUTPUT__0, OUTPUT__1, ..." for given in step.outputs
                 if output_index(model, given) is None]
    return problems


def producers(name: str, pipeline: PipelineConfig, models: dict[str, ModelConfig],
              problems: list[str]) -> dict[str, Producer]:
    """Each tensor of the pipeline and what makes it; a tensor made twice is a problem."""
    made: dict[str, Producer] = {}
    for spec in pipeline.inputs:
        made[spec.name] = Producer(None, spec.dtype, spec.shape, "the pipeline's input")
    for index, step in enumerate(pipeline.steps):
        model = models[step.model]
        for output, tensor in step.outputs.items():
            at = output_index(model, output)
            declared = model.outputs[at] if at is not None and at < len(model.outputs) else None
            producer = Producer(index, declared.dtype if declared else None, declared.shape if declared else None,
                                f"step {step.title} (output {output!r} of model {step.model})")
            if tensor in made:
                problems.append(f"pipelines.{name}.steps[{index}]: tensor {tensor!r} is produced twice, by "
                                f"{made[tensor].said} and by {producer.said}; give each a name of its own")
                continue
            made[tensor] = producer
    return made


def pipeline_problems(name: str, pipeline: PipelineConfig, models: dict[str, ModelConfig]) -> list[str]:
    """Every reason pipeline `name` cannot be served beside `models`, one sentence each."""
    prefix = f"pipelines.{name}"
    if name in models:
        return [f"{prefix}: {name!r} is also a model's name, and a pipeline is served under its own name; "
                "rename one of them"]
    problems: list[str] = []
    titles: dict[str, int] = {}
    for index, step in enumerate(pipeline.steps):
        if step.model not in models:
            problems.append(f"{prefix}.steps[{index}]: step {step.title} names model {step.model!r}, which this "
                            f"daemon does not serve; it serves {', '.join(sorted(models))}")
        elif step.title in titles:
            problems.append(f"{prefix}.steps[{index}]: step name {step.title!r} is also step {titles[step.title]}'s; "
                            'give each step of the same model a name of its own (name = "...")')
        else:
            problems += _step_problems(prefix, index, step, models[step.model])
        titles.setdefault(step.title, index)
    if problems:
        return problems
    made = producers(name, pipeline, models, problems)
    for index, step in enumerate(pipeline.steps):
        model = models[step.model]
        for position, input_name in enumerate(model.input_names()):
            tensor, spec = step.inputs[input_name], model.inputs[position]
            taker = f"{prefix}.steps[{index}]: step {step.title} takes tensor {tensor!r} as input {input_name!r} " \
                    f"of model {step.model}"
            producer = made.get(tensor)
            if producer is None:
                problems.append(f"{taker}, which neither the pipeline's inputs nor any step produces")
            elif producer.step == index:
                problems.append(f"{taker}, which the step itself produces (a cycle)")
            elif producer.dtype is not None and producer.dtype != spec.dtype:
                problems.append(f"{taker}, which is {spec.dtype}, but {producer.said} makes it {producer.dtype}")
            elif producer.shape is not None and not _shapes_agree(producer.shape, spec.shape):
                problems.append(f"{taker}, which takes samples of shape {list(spec.shape)}, but {producer.said} "
                                f"makes them {list(producer.shape)}")
    problems += [f"{prefix}.outputs: tensor {tensor!r} is an output of the pipeline, but no step produces it"
                 for tensor in pipeline.outputs if tensor not in made or made[tensor].step is None]
    if not problems:
        problems += _cycle(prefix, pipeline, made)
    return problems


def _cycle(prefix: str, pipeline: PipelineConfig, made: dict[str, Producer]) -> list[str]:
    """The sentence naming the steps that can never run because they wait on one another, and a tensor one
    of them waits for; none when every step can run."""
    stuck = sorted(set(range(len(pipeline.steps))) - set(order(pipeline, made)))
    if not stuck:
        return []
    first = pipeline.steps[stuck[0]]
    tensor = next(t for t in first.inputs.values() if made[t].step in stuck)
    return [f"{prefix}.steps: steps {', '.join(pipeline.steps[i].title for i in stuck)} each wait for another's "
            f"output (a cycle: step {first.title} takes tensor {tensor!r} from {made[tensor].said}), so none can run"]


def waits_on(pipeline: PipelineConfig, made: dict[str, Producer]) -> list[set[int]]:
    """For each step, the steps whose outputs it takes."""
    return [{step for tensor in s.inputs.values() if (step := made[tensor].step) is not None}
            for s in pipeline.steps]


def order(pipeline: PipelineConfig, made: dict[str, Producer]) -> list[int]:
    """The steps in an order each can run in (each after those it waits on); those of a cycle are left out."""
    waiting = waits_on(pipeline, made)
    done: list[int] = []
    progress = True
    while progress:
        progress = False
        for index, before in enumerate(waiting):
            if index not in done and before <= set(done):
                done.append(index)
                progress = True
    return done
