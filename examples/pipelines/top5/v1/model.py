"""A top-5 step: a classifier's logits in, its five likeliest classes' labels (BYTES) and probabilities out.

The labels are made here (`class 0` ... `class 999`), so the step needs no file: a real one would read
ImageNet's names from a file of its version's folder (`context.version_dir`).
"""

import numpy as np

import inferd

TOP = 5


class Model:
    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = inputs["logits"]
        if not np.isfinite(logits).all():  # those requests alone are answered 400
            raise inferd.InvalidInput("the logits must be finite numbers")
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities = z / z.sum(axis=1, keepdims=True)
        best = np.argsort(-probabilities, axis=1, kind="stable")[:, :TOP]
        labels = np.vectorize(lambda index: f"class {index}".encode(), otypes=[object])(best)
        return {"labels": labels, "scores": np.take_along_axis(probabilities, best, axis=1)}
