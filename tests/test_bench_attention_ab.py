"""bench/attention_ab.py without a GPU: its command line refuses bad shapes, head counts,
rounds and forms by name before it touches a device, and every diagnostic ablation still
applies to the tree's kernel (one that no longer does fails here, naming itself)."""

from __future__ import annotations

import pytest

from bench.attention_ab import ABLATIONS, load_form, parse_args, parse_shape, write_ablation


def test_shapes_parse_and_bad_ones_are_named():
    assert parse_shape("64x1024") == (64, 1024)
    for bad in ("64", "64x", "0x1024", "64x-1", "ax1"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_shape(bad)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["f.py", "--shapes", "64y1024"], "'64y1024'"),
        (["f.py", "--heads", "100"], "--heads 100"),
        (["f.py", "--rounds", "0"], "--rounds 0"),
        ([], "at least one form file or --ablations"),
        (["--ablations", "nothing"], "'nothing'"),
        (["f.py", "--shapes", "64x1024", "--table-width", "16"], "--table-width 16"),
    ],
)
def test_bad_arguments_exit_naming_the_value(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_a_form_must_be_a_file_defining_the_launch(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_form(str(tmp_path / "missing.py"))
    form = tmp_path / "empty_form.py"
    form.write_text("X = 1\n")
    with pytest.raises(ValueError, match="no launch_wide_split"):
        load_form(str(form))
    form.write_text("def launch_wide_split(*args):\n    return args\n")
    assert load_form(str(form))(1, 2) == (1, 2)


@pytest.mark.parametrize("name", ABLATIONS)
def test_every_ablation_applies_to_the_trees_kernel(name, tmp_path):
    from bench.attention_ab import KERNEL

    path = write_ablation(name, tmp_path)
    text, tree = path.read_text(), KERNEL.read_text()
    assert text != tree
    for old, new in ABLATIONS[name][1]:
        assert tree.count(old) == 1 and text.count(old) == 0 and new in text
    assert callable(load_form(str(path)))


def test_an_ablation_whose_text_is_gone_names_itself(tmp_path, monkeypatch):
    import bench.attention_ab as ab

    kernel = tmp_path / "gluon_attention.py"
    kernel.write_text("# a kernel without the ablation's text\n")
    monkeypatch.setattr(ab, "KERNEL", kernel)
    with pytest.raises(ValueError, match="ablation 'nocopy'.*0 times"):
        write_ablation("nocopy", tmp_path)
