"""Python stand-ins for the library's OpenVINO operations: a node with the operation's type name and
output, to build and save a graph; a Core with the library that reads the saved model gets the
library's operation in its place (the plugin cannot run a stand-in)."""

from __future__ import annotations

from typing import Callable

import openvino as ov

from kiln.engines.openvino import native


def stand_in(type_name: str, output_shape: Callable[[ov.Node], ov.PartialShape]) -> type:
    """The stand-in class for the library's operation `type_name` (domain kiln): one f32 output of
    output_shape(node)."""

    class StandIn(ov.Op):
        def __init__(self, inputs=None):
            super().__init__(self)
            if inputs is not None:
                self.set_arguments(inputs)
                self.constructor_validate_and_infer_types()

        def validate_and_infer_types(self):
            self.set_output_type(0, ov.Type.f32, output_shape(self))

        def clone_with_new_inputs(self, new_inputs):
            return StandIn(new_inputs)

        def get_type_info(self):
            return ov.DiscreteTypeInfo(type_name, native.DOMAIN)

        def visit_attributes(self, visitor):
            return True

    return StandIn
