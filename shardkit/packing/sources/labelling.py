"""How a walk's samples are labelled, in words: what probe and pack say of every source ("700
classes from folder names: ...", "labels from column 'species'", "unlabelled: ..."), and the folder
layouts that label otherwise than a user may mean, as warnings: image files at two depths, class
folders holding sub-folders. Read from a walk once its items are taken (what it saw as it went:
`SourceWalk.depths`, `samples`, `labelled`). Each convention says which of these words are its own
(`Source.labelling`)."""

from __future__ import annotations

from .base import Labelling, SourceWalk
from .item import display

__all__ = ["SHOWN_CLASSES", "Labelling", "class_names", "column_labels", "folder_labels", "labelling",
           "list_labels", "sidecar_labels"]  # fmt: skip

SHOWN_CLASSES = 5  # class names said in full; more are said as the first three, "...", the last


def labelling(found: SourceWalk, labels: str = "auto") -> Labelling:
    """How `found` (walked whole) labels its samples, under the `labels` mode asked (auto, folders
    or none), and what in its layout may not be what was meant: its convention's words."""
    return found.source.labelling(found, labels)


def sidecar_labels(found: SourceWalk) -> Labelling:
    """A sidecar walk's labels: x.cls files, where a sample has one."""
    if not found.samples:  # (not walked yet: a finished pack that --resume leaves as it is)
        return Labelling("sidecars", 0, "labels from x.cls sidecars, where a sample has one")
    if not found.labelled:
        return Labelling("none", 0, "unlabelled (no sample has an x.cls sidecar)")
    return Labelling(
        "sidecars", 0, f"labels from x.cls sidecars ({found.labelled:,} of {found.samples:,} samples have one)"
    )


def class_names(names: list[str]) -> str:
    """Class names as a summary shows them: all of a few, else the first three and the last."""
    shown = [display(name) for name in names]
    if len(shown) > SHOWN_CLASSES:
        shown = [*shown[:3], "...", shown[-1]]
    return ", ".join(shown)


def _classes(count: int, where: str, names: list[str]) -> str:
    return f"{count:,} class{'es' if count != 1 else ''} from {where}: {class_names(names)}"


def folder_labels(found: SourceWalk, labels: str, files: str = "image files") -> Labelling:
    """A folder walk's labels (top-level folders as classes, or none), and its layout's warning;
    `files` names what it walks ("image files", "videos")."""
    warnings = [warning] if (warning := _depths(found, labels, files)) else []
    if found.classes:
        return Labelling("folders", len(found.classes), _classes(len(found.classes), "folder names", found.classes),
                         warnings)  # fmt: skip
    if labels == "none":
        return Labelling("none", 0, "unlabelled (--labels none)", warnings)
    return Labelling("none", 0, f"unlabelled ({files} at the top level: no class folders)", warnings)


def _depths(found: SourceWalk, labels: str, files: str) -> str:
    """The warning a folder's layout deserves ("" none): files in class folders and in their
    sub-folders (a class is a top-level folder, whatever lies below it), or files at the top level
    and in sub-folders (then no sub-folder is a class)."""
    depths = found.depths
    deep = sorted(depth for depth in depths if depth >= 2)
    if found.classes and deep:
        example = display(depths[deep[0]])
        top = example.split("/", 1)[0]
        label = f"a class is a top-level folder, so everything below {top}/ is class {top!r}"
        if 1 in depths:
            first = display(depths[1])
            return f"{files} sit at two depths: {first} in a class folder, {example} in a sub-folder of one; {label}"
        return f"class folders hold sub-folders (e.g. {example}); {label}"
    below = sorted(depth for depth in depths if depth >= 1)
    if not found.classes and labels == "auto" and 0 in depths and below:
        return (
            f"{files} sit at two depths: {display(depths[0])} at the top level, {display(depths[below[0]])} in a "
            "sub-folder; with files at the top level no sub-folder is a class, so none is labelled"
        )
    return ""


def list_labels(found: SourceWalk) -> Labelling:
    """A list file's labels: class names, whole numbers, or none."""
    if found.classes:
        return Labelling("list", len(found.classes), _classes(len(found.classes), "the list's labels", found.classes))
    if found.listed is not None and any(item.label is not None for item in found.listed.items):
        return Labelling("list", 0, "labels from the list file (whole numbers)")
    return Labelling("none", 0, "unlabelled (the list's lines have no label)")


def column_labels(found: SourceWalk, labels: str) -> Labelling:
    """A table's labels: its label column's class names or whole numbers, or none."""
    column = found.table.config.label_column if found.table is not None else None
    if column is None:
        return Labelling("none", 0, "unlabelled (no label column: name one with --label-column)")
    if labels == "none":
        return Labelling("none", 0, f"unlabelled (--labels none: column {column!r} not read)")
    if found.classes:
        said = _classes(len(found.classes), f"column {column!r}", found.classes)
        return Labelling("column", len(found.classes), said)
    return Labelling("column", 0, f"labels from column {column!r} (whole numbers)")
