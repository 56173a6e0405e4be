"""Spark ML estimator and model: spark_dl training and inference inside ``pyspark.ml.Pipeline``.

    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler
    from spark_dl.ml import TorchEstimator

    pipe = Pipeline(stages=[
        VectorAssembler(inputCols=cols, outputCol="features"),
        TorchEstimator(model="fc", hiddenLayers=[64], inputShape=[len(cols)], numClasses=3,
                       strategy="allreduce", epochs=5, batchSize=32, lr=0.1)])
    model = pipe.fit(df)                 # a PipelineModel
    model.write().save(path)             # the torch weights go to <stage>/data as Parquet
    PipelineModel.load(path).transform(df).select("prediction")

Features: an ML Vector column (dense or sparse: VectorAssembler's output) or an
array<float|double> column, flattened, ``inputShape`` giving the shape of one sample (e.g.
[1, 28, 28] for the CNN); converted in the tasks, never collected. Labels: class ids, Spark ML's
doubles (StringIndexer's 0.0, 1.0, ...) or integers; string labels are refused with the
StringIndexer line to add. ``TorchModel.transform`` runs ``spark_dl.inference.predict_udf``: the
network is rebuilt once per Python worker and fed Arrow batches of ``batchSize`` rows.

The Params that are spark_dl.fit's options (``batchSize`` is fit's ``batch_size``) are made
from their definitions in spark_dl.options, with their ``__init__``/``setParams`` keywords.
"""

from __future__ import annotations

import base64
import functools
import inspect
import io
import math

from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasFeaturesCol, HasLabelCol, HasPredictionCol, HasSeed
from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from . import options
from .errors import ConfigError, DataError
from .preflight import check_label_column

__all__ = ["TorchEstimator", "TorchModel"]


def _text(value) -> str:
    """A Param that is a word or a number (warmupEpochs=1, gradClip="none"), kept as text."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"expected a string or a number, got {value!r}")
    return str(value)


_CONVERTERS = {bool: TypeConverters.toBoolean, int: TypeConverters.toInt,
               float: TypeConverters.toFloat, str: TypeConverters.toString,
               tuple: TypeConverters.toListInt}


def _converter(option: options.Option):
    """A Param's type converter from the option's types (a word or a number: ``_text``; a
    strategy: its name)."""
    types = [t for t in option.plain_types() if t is not dict]
    return _CONVERTERS[types[0]] if len(types) == 1 else _text


class _TorchParams(HasFeaturesCol, HasLabelCol, HasPredictionCol, HasSeed):
    """The Estimator's own Params (the network, Downpour's partitions), and one per option of
    spark_dl.fit that spark_dl.options marks "param" (set on the class below)."""

    model = Param(Params._dummy(), "model", "network: 'fc' (hiddenLayers) or 'cnn' (the "
                  "thesis CNN, inputShape [1, 28, 28])", TypeConverters.toString)
    hiddenLayers = Param(Params._dummy(), "hiddenLayers", "hidden widths of the 'fc' network",
                         TypeConverters.toListInt)
    partitions = Param(Params._dummy(), "partitions", "downpour: column partitions per "
                       "replica (model parallelism)", TypeConverters.toInt)

    def __init__(self):
        super().__init__()
        self._setDefault(**_DEFAULTS)

    def _network(self):
        """A zero-argument factory of the network these params describe (plain values only)."""
        from .models import FCNet, ThesisCNN
        name, shape = self.getOrDefault("model"), list(self.getOrDefault("inputShape"))
        classes, hidden = self.getOrDefault("numClasses"), list(self.getOrDefault("hiddenLayers"))
        if name == "fc":
            if not shape:
                raise ValueError("inputShape must be set, e.g. [784] or [1, 28, 28]")
            sizes = (math.prod(shape), *hidden, classes)
            return lambda: FCNet(sizes)
        if name == "cnn":
            channels = shape[0] if len(shape) == 3 else 1
            return lambda: ThesisCNN(num_classes=classes, in_channels=channels)
        raise ValueError(f"model must be 'fc' or 'cnn', got {name!r}")


for _option in options.on("param"):         # featuresCol, labelCol, seed: Spark ML's own
    if not hasattr(_TorchParams, options.param_name(_option)):
        setattr(_TorchParams, options.param_name(_option),
                Param(Params._dummy(), options.param_name(_option),
                      f"{_option.doc} (spark_dl.fit's {_option.name})", _converter(_option)))

# every Param's default: the Estimator's own, then the options' (spark_dl.options)
_DEFAULTS = {"predictionCol": "prediction", "model": "fc", "hiddenLayers": [128],
             "partitions": 1,
             **{options.param_name(o): options.default(o, "param") for o in options.on("param")}}


def _keywords(method):
    """``method(self, **params)`` keyword-only over the Params (its signature lists them with
    their defaults, for help and IDEs); an unknown keyword is a TypeError listing them."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(_DEFAULTS))
        if args or unknown:
            raise TypeError(f"{method.__name__} takes Params by name, got "
                            f"{', '.join(map(repr, unknown)) or f'{len(args)} positional'}; "
                            f"the Params: {', '.join(sorted(_DEFAULTS))}")
        self._input_kwargs = kwargs
        return method(self, **kwargs)
    wrapper.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] +
        [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v)
         for k, v in _DEFAULTS.items()])
    return wrapper


def _from_param(option: options.Option, value):
    """A Param's value as fit takes the option."""
    value = options.to_fit(option, value)
    if option.name == "shape":
        return tuple(value)
    if option.name == "warmup_epochs":
        return _auto_or_number("warmupEpochs", value)
    if option.name == "grad_clip":
        return _auto_or_number("gradClip", value, off=True)
    return value

def _auto_or_number(name: str, value: str, off: bool = False):
    """A word-or-number Param as fit takes it: "auto", None for "none" (where ``off``), or a
    number >= 0 (fit checks the rest, e.g. a warmup longer than the fit); anything else a
    ConfigError naming the Param."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if off and text in ("none", "off"):
        return None
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if math.isfinite(number) and number >= 0:
        return number
    words = "'auto', 'none' or a number >= 0" if off else "'auto' or a number >= 0"
    raise ConfigError(f"{name} must be {words}, got {value!r}")


def _features_array(df, col: str):
    """The features column as array<float> (ML Vectors converted), or a clear error."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, DoubleType, FloatType
    if col not in df.columns:
        raise DataError(f"features column {col!r} not in the DataFrame (columns: "
                        f"{df.columns}); set featuresCol, or assemble one with VectorAssembler")
    dtype = df.schema[col].dataType
    if isinstance(dtype, VectorUDT):
        return vector_to_array(F.col(col), "float32")
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, (FloatType, DoubleType)):
        return F.col(col).cast("array<float>")
    raise DataError(f"features column {col!r} is {dtype.simpleString()}; it must be an ML "
                    f"Vector or array<float>/array<double> (use VectorAssembler)")


class TorchEstimator(Estimator, _TorchParams, MLReadable, MLWritable):
    """Trains a spark_dl network with ``spark_dl.fit``; ``fit(df)`` returns a TorchModel."""

    @_keywords
    def __init__(self, **params):
        super().__init__()
        self.setParams(**self._input_kwargs)

    @_keywords
    def setParams(self, **params):
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        if "gradClip" in self._input_kwargs and self._input_kwargs["gradClip"] is None:
            kwargs["gradClip"] = "none"                  # off, as fit's grad_clip=None
        return self._set(**kwargs)

    def _fit(self, dataset):
        from pyspark.sql import functions as F

        from .fit import fit
        from .strategies import make_strategy
        g = self.getOrDefault
        given = {o.name: _from_param(o, g(options.param_name(o))) for o in options.on("param")}
        feats = _features_array(dataset, g("featuresCol"))
        if g("labelCol") not in dataset.columns:
            raise DataError(f"label column {g('labelCol')!r} not in the DataFrame (columns: "
                            f"{dataset.columns}); set labelCol")
        check_label_column(dataset, g("labelCol"), "labelCol")
        # the labels as they are (Spark ML's doubles 0.0, 1.0, ...: class ids, checked whole
        # and in 0..numClasses-1 as the tasks read them), under their own names
        df = dataset.select(feats.alias(g("featuresCol")), F.col(g("labelCol")))
        partitions = {"partitions": g("partitions")} if g("partitions") != 1 else {}
        given.update(features=g("featuresCol"), label=g("labelCol"),
                     strategy=make_strategy(given["strategy"], **partitions))
        res = fit(df, self._network(), **given, log=None)
        buf = io.BytesIO()
        import torch
        torch.save(res.model.state_dict(), buf)
        model = TorchModel(state=buf.getvalue())
        self._copyValues(model)
        model.history = res.history
        return model

    def write(self) -> MLWriter:
        return DefaultParamsWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return DefaultParamsReader(cls)


class TorchModel(Model, _TorchParams, MLReadable, MLWritable):
    """A trained network; ``transform`` adds ``predictionCol`` (the class, as a double)."""

    def __init__(self, state: bytes | None = None):
        super().__init__()
        self.state = state
        self.history: list = []

    def _transform(self, dataset):
        import torch

        from .inference import predict_udf
        if self.state is None:
            raise ValueError("this TorchModel holds no weights; fit a TorchEstimator or load one")
        net = self._network()()
        net.load_state_dict(torch.load(io.BytesIO(self.state), weights_only=True))
        shape = list(self.getOrDefault("inputShape")) or [1, 28, 28]      # 'cnn' default
        predict = predict_udf(net, shape, output="class",
                              batch_size=self.getOrDefault("batchSize"))
        feats = _features_array(dataset, self.getOrDefault("featuresCol"))
        return dataset.withColumn(self.getOrDefault("predictionCol"), predict(feats))

    def write(self) -> MLWriter:
        return _TorchModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _TorchModelReader(cls)


class _TorchModelWriter(MLWriter):
    """Params as Spark ML metadata (DefaultParamsWriter), the weights as one Parquet row."""

    def __init__(self, instance: TorchModel):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        self.sparkSession.createDataFrame(
            [(base64.b64encode(self.instance.state).decode(),)], "state string") \
            .coalesce(1).write.mode("overwrite").parquet(f"{path}/data")


class _TorchModelReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> TorchModel:
        meta = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        row = self.sparkSession.read.parquet(f"{path}/data").collect()[0]
        model = TorchModel(state=base64.b64decode(row.state))
        DefaultParamsReader.getAndSetParams(model, meta)
        model._resetUid(meta["uid"])
        return model
