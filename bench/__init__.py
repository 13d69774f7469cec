"""Benchmarks of caffejax against OpenCV DNN and Caffe (``python -m bench.run --help``; README "Benchmarks")."""
