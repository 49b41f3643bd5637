"""DataConfig.load: the data set its options name, cut to the first --train-examples training
images (the test set whole); more than the set has is one line naming both counts; a resume
tells a cut set from the whole one (its identity holds the size and a hash of the images)."""

import pytest
import torch

from phalanx.data.config import DataConfig
from phalanx.errors import UsageError
from phalanx.job.resume import dataset_identity


def _quiet(_line: str) -> None:
    pass


def test_train_examples_keeps_the_first_n_training_images_and_the_whole_test_set():
    whole = DataConfig(dataset="synthetic").load(log=_quiet)
    cut = DataConfig(dataset="synthetic", train_examples=100).load(log=_quiet)
    assert (cut.num_train, cut.num_test) == (100, whole.num_test)
    assert torch.equal(cut.train_images, whole.train_images[:100])
    assert torch.equal(cut.train_labels, whole.train_labels[:100])
    assert torch.equal(cut.test_images, whole.test_images) and cut.name == whole.name


def test_all_of_them_is_the_default_and_every_image_may_be_asked_for():
    whole = DataConfig(dataset="synthetic").load(log=_quiet)
    assert DataConfig(dataset="synthetic", train_examples=whole.num_train).load(log=_quiet).num_train == whole.num_train


def test_more_than_the_set_has_is_refused_in_one_line():
    with pytest.raises(UsageError) as info:
        DataConfig(dataset="synthetic", train_examples=6001).load(log=_quiet)
    assert str(info.value) == ("--train-examples 6001 is more than the 6000 training images synthetic has; use at "
                               "most 6000, or leave it out for all of them")


def test_a_checkpoint_of_the_whole_set_is_not_one_of_its_first_images():
    cut = dataset_identity(DataConfig(dataset="synthetic", train_examples=3000).load(log=_quiet))
    assert cut == dataset_identity(DataConfig(dataset="synthetic", train_examples=3000).load(log=_quiet))
    assert cut != dataset_identity(DataConfig(dataset="synthetic").load(log=_quiet))
    assert cut["num_train"] == 3000
