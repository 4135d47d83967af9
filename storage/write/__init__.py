"""storage/write"""
