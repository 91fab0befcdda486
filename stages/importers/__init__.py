"""Cameras another tool already made: COLMAP models, ``transforms.json`` files and LLFF poses.

Each reader turns one kind of camera file into an :class:`ImportedScene` (image names, one
:class:`Camera` per image, camera-to-world poses in OpenCV axes, optional sparse points, an
optional given split and scene-box hints): ``colmap.py``, ``transforms.py``, ``llff.py``, on the
structure and checks of ``scene.py``. The poses stage (``source: colmap | transforms | llff``)
calls :func:`run_import` (``stage.py``), which matches the scene's images to the ingested ones
and writes the same outs as structure from motion does.

Accepted layouts (see docs/contracts.md, "Imported cameras"):

* COLMAP: a model folder with ``cameras``, ``images`` and (optionally) ``points3D`` as
  ``.bin`` or ``.txt``; or a folder holding ``sparse/0``. Image names are relative to the
  ``images/`` folder beside ``sparse/``. Models: SIMPLE_PINHOLE, PINHOLE, SIMPLE_RADIAL,
  RADIAL, OPENCV, FULL_OPENCV.
* ``transforms.json``: instant-ngp (shared intrinsics at the top level) and nerfstudio
  (per-frame intrinsics, ``camera_model``, ``applied_transform``, ``ply_file_path``,
  ``train_filenames``/``test_filenames``); a folder with ``transforms_train.json`` (+
  ``transforms_test.json``) is the Blender / nerf_synthetic layout, whose split is kept.
* LLFF: ``poses_bounds.npy`` (N x 17), rows matched to the images in sorted-name order.

Every image path a camera file names must stay inside the folder it is relative to (no
``..``, no absolute path or symlink leading outside); every malformed input is a
``ValueError`` that names the file and the problem.
"""
from .colmap import (find_colmap_model, parse_cameras_bin, parse_cameras_txt, parse_images_bin,
                     parse_images_txt, parse_points3d_bin, parse_points3d_txt, read_colmap)
from .llff import parse_poses_bounds, read_llff
from .scene import (COLMAP_MODELS, IMAGE_EXTS, SUPPORTED_MODELS, Camera, ImportedScene, resolve_inside,
                    rigid)
from .stage import focus_aabb, match_images, read_cameras, read_manifest, run_import, scene_aabb
from .transforms import CAMERA_KEYS, parse_transforms, read_blender, read_transforms

__all__ = ["CAMERA_KEYS", "COLMAP_MODELS", "IMAGE_EXTS", "SUPPORTED_MODELS", "Camera", "ImportedScene",
           "find_colmap_model", "focus_aabb", "match_images", "parse_cameras_bin", "parse_cameras_txt",
           "parse_images_bin", "parse_images_txt", "parse_points3d_bin", "parse_points3d_txt",
           "parse_poses_bounds", "parse_transforms", "read_blender", "read_cameras", "read_colmap", "read_llff",
           "read_manifest", "read_transforms", "resolve_inside", "rigid", "run_import", "scene_aabb"]
