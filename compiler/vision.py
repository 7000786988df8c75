"""The vision towers the runtime provides: the one list the compiler reads them from.

The schema accepts these names for ``vision.tower``, lint checks what needs which tower, and
codegen wires the tower into the model through its template.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tower:
    module: str  # mlxc.runtime.model.vision.<module>
    template: str  # renders VisionLanguageModel around the text decoder
    inputs: tuple[str, ...]  # what the model takes with the first chunk of a prompt
    tower_class: str | None = None  # the class in `module` (qwen family)
    mrope: bool = False  # keeps MRoPE positions per prompt: gqa `rope.mrope` needs it
    deepstack: bool = False  # returns DeepStack feature sets: `layers.deepstack` needs it
    # rope_index settings of the qwen family (see runtime/model/mrope.py)
    tokens_per_second: bool = False
    frames_as_images: bool = False
    # Image tokens attend to their whole image in prefill (runtime/model/image_attention.py): the
    # TextModel ORs the overlay into its masks, and prefills keep each image in one chunk.
    bidirectional_images: bool = False


def _qwen(tower_class: str, **settings) -> Tower:
    inputs = ("pixel_values", "image_grid_thw")
    return Tower("qwen", "vision_qwen.py.j2", inputs, tower_class, mrope=True, **settings)


# In the order the schema's error messages list them.
TOWERS: dict[str, Tower] = {
    "qwen2_vit": _qwen("Qwen2VisionTower"),
    "qwen2_5_vit": _qwen("Qwen25VisionTower", tokens_per_second=True),
    "qwen3_vit": _qwen("Qwen3VisionTower", deepstack=True, frames_as_images=True),
    "pixtral": Tower("pixtral", "vision_pixtral.py.j2", ("pixel_values", "image_sizes")),
    # SigLIP + the Gemma-3 projector.
    "gemma3_siglip": Tower(
        "siglip", "vision_gemma3.py.j2", ("pixel_values",), bidirectional_images=True
    ),
}
