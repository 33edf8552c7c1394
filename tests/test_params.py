"""One table of the clustering's parameters: the config, the estimator and the kernels read it."""

import inspect
from dataclasses import fields

import pytest

from kfed_spark.config import KFedConfig, load_config
from kfed_spark.core.local_step import local_steps
from kfed_spark.core.reference import federated_kmeans
from kfed_spark.core.server_step import server_step
from kfed_spark.errors import ConfigError
from kfed_spark.estimator import KFed, KFedModel
from kfed_spark.params import DEFAULTS, AlgorithmParams

pytestmark = pytest.mark.fast


def camel(name):
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def test_config_and_estimator_defaults_are_the_tables():
    config, estimator = KFedConfig(), KFed()
    for spec in fields(AlgorithmParams):
        assert getattr(config.algorithm, spec.name) == spec.default, spec.name
        as_param = list(spec.default) if isinstance(spec.default, tuple) else spec.default  # pairs are lists there
        assert estimator.getOrDefault(camel(spec.name)) == as_param, spec.name
        assert spec.metadata["doc"] in estimator.getParam(camel(spec.name)).doc


def test_kernels_defaults_are_the_tables():
    for function in (local_steps, server_step, federated_kmeans):  # they take the table
        assert inspect.signature(function).parameters["params"].default is DEFAULTS


def test_every_param_has_a_keyword_a_getter_and_a_setter():
    kfed = KFed(robustMinSize=0.5, kPerDeviceMax=4)
    assert (kfed.getRobustMinSize(), kfed.getKPerDeviceMax()) == (0.5, 4)
    assert kfed.setK(5).setKPerDevice("auto").getK() == 5
    assert kfed._settings().algorithm.robust_min_size == 0.5 and kfed._settings().algorithm.k_per_device == "auto"
    signature = inspect.signature(KFed.__init__)
    assert signature.parameters["k"].default == DEFAULTS.k and signature.parameters["deviceCol"].default == "device_id"
    assert KFedModel().getLabelMode() == DEFAULTS.label_mode


def test_the_estimator_refuses_what_the_config_refuses():
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        KFed(colour="red")
    with pytest.raises(ConfigError, match="robust_min_size must be a finite number >= 0, got -1.0"):
        KFed(robustMinSize=-1.0)._settings()
    with pytest.raises(ConfigError, match="robust_min_size must be a finite number >= 0, got -1"):
        load_config(None, ["robust_min_size=-1", "input.path=x", "output.path=y"])


def test_the_configuration_page_s_parameter_table_is_the_parameter_table():
    """docs/configuration.md's table between its GENERATED lines is what kfed_spark.params_codegen writes from
    kfed_spark.params: after a change to the table, `python -m kfed_spark.params_codegen` rewrites it."""
    from kfed_spark.params_codegen import CONFIGURATION_PAGE, rewritten_page

    assert rewritten_page(CONFIGURATION_PAGE.read_text()) == CONFIGURATION_PAGE.read_text()
