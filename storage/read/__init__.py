"""storage/read"""
