"""Constants of the data path: ImageNet and Kinetics statistics, the random crop's ranges, the image file
suffixes read, and the entries no walk lists."""

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

#: The statistics torchvision's Kinetics-400 video models were trained with.
KINETICS_MEAN: tuple[float, float, float] = (0.43216, 0.394666, 0.37645)
KINETICS_STD: tuple[float, float, float] = (0.22803, 0.22145, 0.216989)

#: The random-resized crop's ranges of area (a fraction of the image's) and of aspect ratio (width / height):
#: torchvision's ``RandomResizedCrop`` defaults, the ImageNet recipe's.
CROP_SCALE: tuple[float, float] = (0.08, 1.0)
CROP_RATIO: tuple[float, float] = (3 / 4, 4 / 3)

#: Suffixes (lower case) of the files an image folder is made of; anything else is ignored.
IMG_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

#: Suffixes decoded through the JPEG fast path.
JPEG_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg")

#: Depths of the image-file check (see ``cltrain.data.check``).
CHECK_MODES: tuple[str, ...] = ("quick", "full", "off")

#: Files and folders that operating systems and tools leave beside the data (lower case): Windows'
#: thumbnail caches and folder settings, the folder macOS adds to zip archives.
JUNK_NAMES: frozenset[str] = frozenset({"thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini", "__macosx"})


def is_hidden(name: str) -> bool:
    """Whether a folder entry named ``name`` is hidden or left by the system, and so never a class,
    a sample or a clip: a dot name (``.ipynb_checkpoints``, ``.DS_Store``, AppleDouble ``._photo.jpg``,
    ``.git``) or one of ``JUNK_NAMES``. The one rule of every walk (the index, the app's layout check,
    the packer, the data check, the clip folders)."""
    return name.startswith(".") or name.lower() in JUNK_NAMES
