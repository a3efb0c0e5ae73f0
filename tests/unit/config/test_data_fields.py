"""`${data:FIELD}` (src/config/data_fields.py): filled into the model config once the dataset is known, with no
state kept anywhere; before that, resolving says where a value will come from."""

from omegaconf import OmegaConf

from src.config import data_fields


def test_fill_writes_the_values_and_leaves_the_composed_config_as_it_was():
    data_fields.register_resolver()
    model = OmegaConf.create({"_target_": "m.Net", "sizes": "${data:image_size}", "out": "${data:num_outputs}",
                              "blocks": [{"width": "${data:num_features}"}], "depth": 3})
    assert OmegaConf.to_container(model, resolve=True)["out"] == (
        "<num_outputs: filled in at run time from the dataset and task>")  # `--cfg job --resolve`
    fields = {"image_size": (8, 8), "num_outputs": 10, "num_features": 64, "num_classes": 10}
    filled = data_fields.fill(model, fields, "dataset=digits")
    assert OmegaConf.to_container(filled, resolve=True) == {"_target_": "m.Net", "sizes": [8, 8], "out": 10,
                                                            "blocks": [{"width": 64}], "depth": 3}
    assert model.out == "<num_outputs: filled in at run time from the dataset and task>"  # the original: untouched
    assert data_fields.used_by(model, fields) == {"image_size": (8, 8), "num_features": 64, "num_outputs": 10}
