"""dlojz's measurements in a PyTorch Lightning run (docs/lightning.md): `Chronometer`, a Callback
that writes dlojz.py's '>>>' lines, summary.json and metrics.jsonl for any LightningModule, and
`ImageFolderDataModule`, dlojz's loaders as a LightningDataModule.

    import lightning.pytorch as pl
    from dlojzlib.lightning import Chronometer, ImageFolderDataModule
    trainer = pl.Trainer(callbacks=[Chronometer()])
    trainer.fit(model, datamodule=ImageFolderDataModule(data_dir, 256, 10))

Lightning is optional (requirements-lightning.txt): nothing else in dlojz imports this package."""
import importlib.util

MISSING = ('dlojzlib.lightning needs PyTorch Lightning 2.x, which this Python does not have: '
           'pip install -r requirements-lightning.txt')

if importlib.util.find_spec('lightning') is None:  # one sentence, not the import's traceback
    raise ModuleNotFoundError(MISSING, name='lightning')

from dlojzlib.lightning.callback import Chronometer  # noqa: E402
from dlojzlib.lightning.datamodule import ImageFolderDataModule  # noqa: E402

__all__ = ['Chronometer', 'ImageFolderDataModule', 'MISSING']
