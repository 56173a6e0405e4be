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

Features: an ML Vector column or an array<float|double> column, flattened, ``inputShape``
giving the shape of one sample (e.g. [1, 28, 28] for the CNN). ``TorchModel.transform`` runs
``pyspark.ml.functions.predict_batch_udf``: the network is rebuilt once per Python worker and
fed Arrow batches of ``batchSize`` rows.
"""

from __future__ import annotations

import base64
import io
import math

from pyspark import keyword_only
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

from .errors import ConfigError, DataError

__all__ = ["TorchEstimator", "TorchModel"]


def _text(value) -> str:
    """A Param that is a word or a number (warmupEpochs=1, gradClip="none"), kept as text."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"expected a string or a number, got {value!r}")
    return str(value)


class _TorchParams(HasFeaturesCol, HasLabelCol, HasPredictionCol, HasSeed):
    model = Param(Params._dummy(), "model", "network: 'fc' (hiddenLayers) or 'cnn' (the "
                  "thesis CNN, inputShape [1, 28, 28])", TypeConverters.toString)
    hiddenLayers = Param(Params._dummy(), "hiddenLayers", "hidden widths of the 'fc' network",
                         TypeConverters.toListInt)
    inputShape = Param(Params._dummy(), "inputShape", "shape of one sample's features",
                       TypeConverters.toListInt)
    numClasses = Param(Params._dummy(), "numClasses", "number of classes", TypeConverters.toInt)
    strategy = Param(Params._dummy(), "strategy", "'allreduce' or 'downpour'",
                     TypeConverters.toString)
    partitions = Param(Params._dummy(), "partitions", "downpour: column partitions per "
                       "replica (model parallelism)", TypeConverters.toInt)
    replicas = Param(Params._dummy(), "replicas", "replicas (0: the cluster's task slots)",
                     TypeConverters.toInt)
    epochs = Param(Params._dummy(), "epochs", "passes over the data", TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", "mini-batch per replica (and inference "
                      "batch)", TypeConverters.toInt)
    optimizer = Param(Params._dummy(), "optimizer", "sgd, adam, adagrad, rmsprop, ...",
                      TypeConverters.toString)
    lr = Param(Params._dummy(), "lr", "learning rate", TypeConverters.toFloat)
    momentum = Param(Params._dummy(), "momentum", "SGD momentum", TypeConverters.toFloat)
    nesterov = Param(Params._dummy(), "nesterov", "SGD's momentum in Nesterov's form "
                     "(allreduce, gossip; spark_dl.fit's nesterov)", TypeConverters.toBoolean)
    lrScaling = Param(Params._dummy(), "lrScaling", "lr for the global batch of several "
                      "replicas: auto, linear, sqrt or none (spark_dl.fit's lr_scaling)",
                      TypeConverters.toString)
    warmupEpochs = Param(Params._dummy(), "warmupEpochs", "epochs to reach the scaled lr: "
                         "auto, or a number (spark_dl.fit's warmup_epochs)", _text)
    gradClip = Param(Params._dummy(), "gradClip", "gradient norm cut of a scaled lr: auto, "
                     "none, or a maximum norm (spark_dl.fit's grad_clip)", _text)

    def __init__(self):
        super().__init__()
        self._setDefault(model="fc", hiddenLayers=[128], inputShape=[], numClasses=2,
                         strategy="allreduce", partitions=1, replicas=0, epochs=1, batchSize=64,
                         optimizer="sgd", lr=0.05, momentum=0.9, nesterov=False, seed=0,
                         lrScaling="auto", warmupEpochs="auto", gradClip="auto",
                         featuresCol="features", labelCol="label", predictionCol="prediction")

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

    @keyword_only
    def __init__(self, *, featuresCol="features", labelCol="label",
                 predictionCol="prediction", model="fc", hiddenLayers=None, inputShape=None,
                 numClasses=2, strategy="allreduce", partitions=1, replicas=0, epochs=1,
                 batchSize=64, optimizer="sgd", lr=0.05, momentum=0.9, nesterov=False,
                 seed=0, lrScaling="auto", warmupEpochs="auto", gradClip="auto"):
        super().__init__()
        self.setParams(**self._input_kwargs)

    @keyword_only
    def setParams(self, *, featuresCol="features", labelCol="label",
                  predictionCol="prediction", model="fc", hiddenLayers=None, inputShape=None,
                  numClasses=2, strategy="allreduce", partitions=1, replicas=0, epochs=1,
                  batchSize=64, optimizer="sgd", lr=0.05, momentum=0.9, nesterov=False,
                  seed=0, lrScaling="auto", warmupEpochs="auto", gradClip="auto"):
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        if "gradClip" in self._input_kwargs and self._input_kwargs["gradClip"] is None:
            kwargs["gradClip"] = "none"                  # off, as fit's grad_clip=None
        return self._set(**kwargs)

    def _fit(self, dataset):
        from pyspark.sql import functions as F

        from .fit import fit
        g = self.getOrDefault
        warmup = _auto_or_number("warmupEpochs", g("warmupEpochs"))
        clip = _auto_or_number("gradClip", g("gradClip"), off=True)
        feats = _features_array(dataset, g("featuresCol"))
        if g("labelCol") not in dataset.columns:
            raise DataError(f"label column {g('labelCol')!r} not in the DataFrame (columns: "
                            f"{dataset.columns}); set labelCol")
        df = dataset.select(feats.alias("features"),
                            F.col(g("labelCol")).cast("long").alias("label"))
        shape = list(g("inputShape"))
        from .strategies import make_strategy
        partitions = {"partitions": g("partitions")} if g("partitions") != 1 else {}
        res = fit(df, self._network(), strategy=make_strategy(g("strategy"), **partitions),
                  shape=tuple(shape),
                  num_classes=g("numClasses"), optimizer=g("optimizer"), lr=g("lr"),
                  momentum=g("momentum"), nesterov=g("nesterov"), lr_scaling=g("lrScaling"),
                  warmup_epochs=warmup, grad_clip=clip, epochs=g("epochs"),
                  batch_size=g("batchSize"),
                  replicas=g("replicas") or None, seed=g("seed"), log=None)
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
