"""The other modes of dlojz.py, imported only when asked for: the loader doctor (--tune-loader),
the tuner (--tune) and the trial runner they share."""
