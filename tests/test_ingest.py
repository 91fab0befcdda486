"""Ingest (stages/ingest.py) on tiny generated photo folders."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stages import ingest
from stages.common.params import ParamsError, load_section

PARAMS = ingest.IngestParams(photos="unused", max_size=0, min_images=3)


def _rgb(w=40, h=30, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), mode="RGB")


def _jpeg_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95, **kw)
    return buf.getvalue()


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def _by_source(manifest):
    return {im["source"]: im for im in manifest["images"]}


def test_exif_rotated_jpeg_comes_out_upright(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    stored = np.zeros((20, 40, 3), np.uint8)
    stored[:, :20] = (255, 0, 0)  # left half red
    stored[:, 20:] = (0, 0, 255)  # right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # display = stored rotated 90 degrees clockwise
    (photos / "rot.jpg").write_bytes(_jpeg_bytes(Image.fromarray(stored), exif=exif))
    for i in range(2):
        _rgb(seed=i).save(photos / f"plain_{i}.png")
    manifest = ingest.run(PARAMS, photos, tmp_path / "out")
    rec = _by_source(manifest)["rot.jpg"]
    assert rec["exif_orientation"] == 6
    assert (rec["width"], rec["height"]) == (20, 40)
    with Image.open(tmp_path / "out" / rec["file"]) as im:
        out = np.asarray(im, dtype=int)
    assert out.shape == (40, 20, 3)
    assert out[5, 10, 0] > 200 and out[5, 10, 2] < 60  # the left (red) half is now on top
    assert out[35, 10, 2] > 200 and out[35, 10, 0] < 60
    assert _by_source(manifest)["plain_0.png"]["exif_orientation"] == 1


def test_modes_converted_to_rgb8(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.fromarray(np.full((12, 16), 77, np.uint8), mode="L").save(photos / "gray.png")
    Image.fromarray(np.full((12, 16), 32896, np.uint16)).save(photos / "deep.png")  # I;16, 128 * 257
    Image.fromarray(np.full((12, 16), 65535, np.uint16)).save(photos / "deep.tif")
    Image.new("CMYK", (16, 12), (0, 255, 255, 0)).save(photos / "cmyk.jpg", quality=95)  # red
    rgba = np.zeros((12, 16, 4), np.uint8)
    rgba[..., 1] = 200
    Image.fromarray(rgba, mode="RGBA").save(photos / "alpha.png")  # fully transparent green
    Image.new("P", (16, 12), 3).save(photos / "palette.bmp")
    Image.new("1", (16, 12), 1).save(photos / "bw.tiff")
    _rgb(16, 12).save(photos / "colour.WEBP", lossless=True)
    manifest = ingest.run(PARAMS, photos, tmp_path / "out")
    recs = _by_source(manifest)
    assert set(recs) == {"gray.png", "deep.png", "deep.tif", "cmyk.jpg", "alpha.png", "palette.bmp", "bw.tiff",
                         "colour.WEBP"}
    assert not manifest["skipped"]

    def px(src):
        with Image.open(tmp_path / "out" / recs[src]["file"]) as im:
            assert (im.mode, im.size) == ("RGB", (16, 12))
            return np.asarray(im)[6, 8].tolist()

    assert px("gray.png") == [77, 77, 77]
    assert px("deep.png") == [128, 128, 128]  # scaled from 16 bits, not clipped to 255
    assert px("deep.tif") == [255, 255, 255]
    r, g, b = px("cmyk.jpg")
    assert r > 200 and g < 40 and b < 40
    assert px("alpha.png") == [0, 200, 0]  # alpha dropped, colour kept
    assert any("alpha" in n for n in recs["alpha.png"]["notes"])
    assert any("16-bit" in n for n in recs["deep.png"]["notes"])
    assert px("bw.tiff") == [255, 255, 255]
    px("palette.bmp")
    for rec in manifest["images"]:  # manifest hashes are those of the written PNGs
        data = (tmp_path / "out" / rec["file"]).read_bytes()
        assert rec["sha256"] == hashlib.sha256(data).hexdigest()


def test_bad_files_skipped_with_reasons_and_duplicates(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    good = _jpeg_bytes(_rgb(64, 48))
    (photos / "a.jpg").write_bytes(good)
    (photos / "a_copy.jpg").write_bytes(good)  # same bytes
    _rgb(seed=1).save(photos / "b.png")
    _rgb(seed=2).save(photos / "c.png")
    (photos / "c.jpg").write_bytes(_jpeg_bytes(_rgb(seed=3)))  # same stem as c.png
    (photos / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg" * 3)
    (photos / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (photos / "empty.png").write_bytes(b"")
    (photos / "notes.txt").write_text("hello")
    (photos / "IMG_1.HEIC").write_bytes(b"\x00" * 10)
    (photos / "sub").mkdir()
    manifest = ingest.run(PARAMS, photos, tmp_path / "out")
    assert [im["source"] for im in manifest["images"]] == ["a.jpg", "b.png", "c.jpg", "c.png"]
    assert [im["file"] for im in manifest["images"]] == ["images/a.png", "images/b.png", "images/c.png",
                                                          "images/c-2.png"]
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == ["a.png", "b.png", "c-2.png",
                                                                                "c.png"]
    reasons = {s["source"]: s["reason"] for s in manifest["skipped"]}
    assert set(reasons) == {"a_copy.jpg", "corrupt.jpg", "truncated.jpg", "empty.png", "notes.txt",
                            "IMG_1.HEIC", "sub"}
    assert "duplicate of a.jpg" in reasons["a_copy.jpg"]
    assert "corrupt" in reasons["corrupt.jpg"]
    assert "truncated" in reasons["truncated.jpg"]
    assert "0 bytes" in reasons["empty.png"]
    assert "not an image" in reasons["notes.txt"]
    assert "convert" in reasons["IMG_1.HEIC"]
    assert manifest["ground_truth"] is None
    assert not (tmp_path / "out" / "ground_truth.json").exists()


def _gt_folder(tmp_path, n=4, w=64, h=48):
    photos = tmp_path / "photos"
    photos.mkdir()
    frames = []
    for i in range(n):
        _rgb(w, h, seed=i).save(photos / f"view_{i:03d}.png")
        w2c = np.eye(4)
        w2c[2, 3] = 3.0 + i
        frames.append({"file": f"view_{i:03d}.png", "world_to_camera": w2c.tolist()})
    frames.append({"file": "view_999.png", "world_to_camera": np.eye(4).tolist()})  # no such photo
    gt = {"intrinsics": {"width": w, "height": h, "fx": 60.0, "fy": 61.0, "cx": 32.0, "cy": 24.0},
          "frames": frames, "scene": {"center": [0, 0, 0.3], "radius": 1.5}}
    (photos / "ground_truth.json").write_text(json.dumps(gt))
    return photos


def test_max_size_downscales_and_rescales_ground_truth(tmp_path):
    photos = _gt_folder(tmp_path)
    params = ingest.IngestParams(photos=str(photos), max_size=32, min_images=3)
    manifest = ingest.run(params, photos, tmp_path / "out")
    assert manifest["ground_truth"] == "ground_truth.json"
    assert "ground_truth.json" not in {s["source"] for s in manifest["skipped"]}
    for rec in manifest["images"]:
        assert (rec["width"], rec["height"]) == (32, 24)
        with Image.open(tmp_path / "out" / rec["file"]) as im:
            assert im.size == (32, 24)
    gt = json.loads((tmp_path / "out" / "ground_truth.json").read_text())
    assert gt["intrinsics"] == {"width": 32, "height": 24, "fx": 30.0, "fy": 30.5, "cx": 16.0, "cy": 12.0}
    assert [f["file"] for f in gt["frames"]] == [f"view_{i:03d}.png" for i in range(4)]  # view_999 dropped
    assert gt["frames"][1]["world_to_camera"][2][3] == 4.0
    assert gt["scene"] == {"center": [0, 0, 0.3], "radius": 1.5}


def test_ground_truth_kept_as_is_without_downscale(tmp_path):
    photos = _gt_folder(tmp_path)
    ingest.run(PARAMS, photos, tmp_path / "out")
    gt = json.loads((tmp_path / "out" / "ground_truth.json").read_text())
    assert gt["intrinsics"] == {"width": 64, "height": 48, "fx": 60.0, "fy": 61.0, "cx": 32.0, "cy": 24.0}


def test_bad_ground_truth_is_an_error(tmp_path):
    photos = _gt_folder(tmp_path)
    (photos / "ground_truth.json").write_text('{"frames": []}')
    with pytest.raises(ValueError, match="ground_truth.json.*intrinsics"):
        ingest.run(PARAMS, photos, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_too_few_images_names_the_count_and_leaves_no_outs(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    _rgb(seed=0).save(photos / "a.png")
    _rgb(seed=1).save(photos / "b.png")
    (photos / "c.jpg").write_bytes(b"")
    out = tmp_path / "out"
    (out / "images").mkdir(parents=True)
    (out / "manifest.json").write_text("{}")  # stale outs of an earlier run
    with pytest.raises(ValueError, match=r"found 2 readable image\(s\).*at least 3.*c\.jpg: empty file"):
        ingest.run(PARAMS, photos, out)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.*"))  # nor the temporary folder


@pytest.mark.parametrize("alpha, expected", [("drop", [0, 200, 0]), ("white", [255, 255, 255]),
                                             ("black", [0, 0, 0])])
def test_alpha_dropped_or_composited(tmp_path, alpha, expected):
    photos = tmp_path / "photos"
    photos.mkdir()
    rgba = np.zeros((12, 16, 4), np.uint8)
    rgba[..., 1] = 200  # green, transparent on the left half, half transparent on the right
    rgba[:, 8:, 3] = 128
    Image.fromarray(rgba, mode="RGBA").save(photos / "alpha.png")
    Image.fromarray(rgba[..., :2], mode="LA").save(photos / "la.png")  # grey + alpha takes the same path
    _rgb(16, 12).save(photos / "plain.png")
    params = ingest.IngestParams(photos="unused", alpha=alpha)
    recs = _by_source(ingest.run(params, photos, tmp_path / "out"))
    with Image.open(tmp_path / "out" / recs["alpha.png"]["file"]) as im:
        out = np.asarray(im, dtype=int)
    assert out[0, 0].tolist() == expected
    if alpha != "drop":  # straight alpha: 200 * a + bg * (1 - a), a = 128 / 255
        bg = 255 if alpha == "white" else 0
        a = 128 / 255
        assert np.abs(out[0, 12] - [bg * (1 - a), 200 * a + bg * (1 - a), bg * (1 - a)]).max() <= 1
    note = "alpha channel dropped" if alpha == "drop" else f"alpha composited on {alpha}"
    assert note in recs["alpha.png"]["notes"] and note in recs["la.png"]["notes"]
    assert recs["plain.png"]["notes"] == []


def test_alpha_kept_as_rgba_and_shrunk_with_the_colours(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    rgba = np.zeros((12, 16, 4), np.uint8)
    rgba[..., 1] = 200
    rgba[:, 8:, 3] = 255  # transparent left half, opaque right half
    Image.fromarray(rgba, mode="RGBA").save(photos / "alpha.png")
    Image.fromarray(np.ascontiguousarray(rgba[..., [1, 3]]), mode="LA").save(photos / "la.png")
    _rgb(16, 12).save(photos / "plain.png")
    recs = _by_source(ingest.run(ingest.IngestParams(photos="unused", alpha="keep"), photos, tmp_path / "out"))
    with Image.open(tmp_path / "out" / recs["alpha.png"]["file"]) as im:
        assert im.mode == "RGBA"
        np.testing.assert_array_equal(np.asarray(im), rgba)  # colour under the transparent half kept too
    with Image.open(tmp_path / "out" / recs["la.png"]["file"]) as im:
        assert im.mode == "RGBA" and np.asarray(im)[0, 0, 3] == 0 and np.asarray(im)[0, 12, 3] == 255
    with Image.open(tmp_path / "out" / recs["plain.png"]["file"]) as im:
        assert im.mode == "RGB"  # no alpha to keep
    assert "alpha kept" in recs["alpha.png"]["notes"] and recs["plain.png"]["notes"] == []
    recs = _by_source(ingest.run(ingest.IngestParams(photos="unused", alpha="keep", max_size=8), photos,
                                 tmp_path / "small"))
    with Image.open(tmp_path / "small" / recs["alpha.png"]["file"]) as im:
        a = np.asarray(im)
    # the alpha edge stays where it was (Lanczos rings by a level or two next to it)
    assert a.shape == (6, 8, 4) and a[:, :3, 3].max() <= 2 and a[:, 5:, 3].min() >= 253


def test_exif_camera_body_and_focal_length_go_in_the_manifest(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    for k, (make, model, focal) in enumerate([("Pixel", "7a", 4.38), ("Apple", "iPhone 12", 26.0), (None, None, None)]):
        exif = Image.Exif()
        if make:
            exif[ingest.EXIF_MAKE], exif[ingest.EXIF_MODEL] = make, model
            exif.get_ifd(ingest.EXIF_IFD)[ingest.EXIF_FOCAL] = focal
            exif.get_ifd(ingest.EXIF_IFD)[ingest.EXIF_FOCAL_35] = 27
        (photos / f"p{k}.jpg").write_bytes(_jpeg_bytes(_rgb(seed=k), exif=exif))
    recs = _by_source(ingest.run(PARAMS, photos, tmp_path / "out"))
    assert recs["p0.jpg"]["camera"] == {"make": "Pixel", "model": "7a", "focal_length_mm": pytest.approx(4.38),
                                        "focal_length_35mm": 27.0}
    assert recs["p1.jpg"]["camera"]["model"] == "iPhone 12" and "camera" not in recs["p2.jpg"]


def test_recursive_keeps_folders_in_source_names(tmp_path):
    photos = tmp_path / "photos"
    for i, rel in enumerate(["train/r_0.png", "test/r_0.png", "top.png", "test/deeper/r_0.png"]):
        (photos / rel).parent.mkdir(parents=True, exist_ok=True)
        _rgb(seed=i).save(photos / rel)
    (photos / "notes.txt").write_text("x")
    (photos / "link").symlink_to(photos / "train")  # folder links are not followed: no copies
    with pytest.raises(ValueError, match="found 1 readable image.*train: a folder .*ingest.recursive: true"):
        ingest.run(PARAMS, photos, tmp_path / "flat")
    params = ingest.IngestParams(photos="unused", recursive=True)
    manifest = ingest.run(params, photos, tmp_path / "out")
    got = [(im["source"], im["file"]) for im in manifest["images"]]
    assert got == [("test/deeper/r_0.png", "images/test_deeper_r_0.png"), ("test/r_0.png", "images/test_r_0.png"),
                   ("top.png", "images/top.png"), ("train/r_0.png", "images/train_r_0.png")]
    assert [(s["source"], s["reason"][:6]) for s in manifest["skipped"]] == [("link", "a link"), ("notes.txt", "not an")]
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == sorted(Path(f).name for _, f in got)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(ValueError, match="photo folder not found: .*nowhere"):
        ingest.run(PARAMS, tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="photo folder is empty"):
        ingest.run(PARAMS, tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "section, key",
    [({"max_size": -1}, "ingest.max_size"), ({"min_images": 2}, "ingest.min_images"),
     ({"max_size": "big"}, "ingest.max_size"), ({"photo": "x"}, "ingest.photo")],
)
def test_bad_params_name_the_key(section, key):
    with pytest.raises(ParamsError, match=key.replace(".", r"\.")):
        load_section(ingest.IngestParams, "ingest", data={"ingest": section})


def test_main_reports_errors_without_traceback(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text(f"ingest: {{photos: {tmp_path / 'nowhere'}, max_size: 0, min_images: 3}}\n")
    assert ingest.main(["--out", str(tmp_path / "out"), "--params", str(params)]) == 1
    err = capsys.readouterr().err
    assert "photo folder not found" in err and "Traceback" not in err
    params.write_text("ingest: {max_sise: 10}\n")
    assert ingest.main(["--photos", str(tmp_path), "--out", str(tmp_path / "out"), "--params", str(params)]) == 1
    err = capsys.readouterr().err
    assert "ingest.max_sise" in err and "Traceback" not in err


def test_main_ingests_with_photos_argument(tmp_path):
    photos = _gt_folder(tmp_path, n=3)
    params = tmp_path / "params.yaml"
    params.write_text("ingest: {photos: elsewhere, max_size: 0, min_images: 3}\n")
    assert ingest.main(["--photos", str(photos), "--out", str(tmp_path / "out"), "--params", str(params)]) == 0
    assert len(_manifest(tmp_path / "out")["images"]) == 3
