"""An image step: each request's JPEG (or PNG) bytes in, the image decoded, resized and scaled to [0, 1] out, as
float32 [3, SIZE, SIZE] (channels first, as torchvision's models take it)."""

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

import inferd

SIZE = 32


class Model:
    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pixels = []
        for data in inputs["image"][:, 0]:
            try:
                image = Image.open(io.BytesIO(data)).convert("RGB")
            except (UnidentifiedImageError, OSError) as exc:  # this request alone is answered 400
                raise inferd.InvalidInput(f"the image cannot be decoded: {exc}") from None
            resized = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
            pixels.append(np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0)
        return {"pixels": np.stack(pixels)}
