import torch

from moe_kernels.tiling import map_row_tiles, pad_rows


def test_pad_rows_to_tile_multiple():
    x = torch.ones(5, 3)
    padded = pad_rows(x, 4)
    assert padded.shape == (8, 3)
    assert torch.equal(padded[:5], x) and not padded[5:].any()
    assert pad_rows(torch.ones(8, 3), 4).shape == (8, 3)
    assert pad_rows(torch.ones(0, 3), 4).shape == (4, 3)


def test_map_row_tiles_calls_fn_on_fixed_shapes_only():
    shapes = []

    def fn(tile):
        shapes.append(tuple(tile.shape))
        return tile.sum(-1, keepdim=True).repeat(1, 2)

    x = torch.arange(33.0).view(11, 3)
    out = map_row_tiles(fn, x, 4)
    assert shapes == [(4, 3)] * 3
    assert torch.equal(out, x.sum(-1, keepdim=True).repeat(1, 2))


def test_map_row_tiles_empty_input_keeps_fn_output_shape():
    out = map_row_tiles(lambda tile: tile[:, :1].to(torch.int64), torch.zeros(0, 5), 4)
    assert out.shape == (0, 1) and out.dtype == torch.int64
