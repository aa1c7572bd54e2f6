"""Batched augmentation steps beyond the crop: each acts on a whole batch at once, with
parameters drawn per sample, on whatever device the batch lies (``color``: ColorJitter and
RandomGrayscale; ``erasing``: RandomErasing; ``mixup``: Mixup and CutMix)."""
