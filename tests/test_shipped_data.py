"""hf_primal.tools.data: the shipped texts read by name equal the files as the data README describes them, unknown
names are refused naming the allowed ones, and the bundled MiniLM folder is a checkpoint."""

import csv
import json
from pathlib import Path

import pytest

from hf_primal.tools import data

FOLDER = Path(__file__).resolve().parents[1] / "hf_primal" / "tools" / "data"


def test_texts_equal_the_files_and_are_what_the_data_readme_says():
    calibration, heldout = data.calibration_texts(), data.heldout_texts()
    assert calibration == (FOLDER / "calibration.txt").read_text(encoding="utf-8").splitlines()
    assert heldout == (FOLDER / "heldout.txt").read_text(encoding="utf-8").splitlines()
    assert (len(calibration), len(heldout)) == (320, 240)
    assert not set(calibration) & set(heldout)  # held-out means disjoint
    reviews = data.sentiment_reviews()
    with open(FOLDER / "sentiment.csv", newline="", encoding="utf-8") as handle:
        assert reviews == [(row["text"], int(row["label"])) for row in csv.DictReader(handle)]
    assert len(reviews) == 480 and sum(label for _, label in reviews) == 240


def test_paths_name_the_shipped_files():
    assert Path(data.data_dir()) == FOLDER
    assert [Path(data.data_file(name)) for name in data.FILES] == [FOLDER / name for name in data.FILES]
    with pytest.raises(ValueError, match=r"'train\.csv' is not a file shipped.*calibration\.txt, heldout\.txt"):
        data.data_file("train.csv")


def test_minilm_path_is_the_bundled_checkpoint():
    config = json.loads((Path(data.minilm_path()) / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("bert", 6, 384)
