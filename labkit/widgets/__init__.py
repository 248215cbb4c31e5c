"""The chapters' ipywidgets, one module per chapter. Each widget is a thin UI around a plain
labkit function (its callback), which the unit tests call directly."""
