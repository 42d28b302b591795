"""Constants of the data path: ImageNet statistics and the image file suffixes read."""

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

#: Suffixes (lower case) of the files an image folder is made of; anything else is ignored.
IMG_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

#: Suffixes decoded through the JPEG fast path.
JPEG_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg")

#: Depths of the image-file check (see ``cltrain.data.check``).
CHECK_MODES: tuple[str, ...] = ("quick", "full", "off")
